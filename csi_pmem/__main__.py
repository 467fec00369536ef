"""Allow `python -m csi_pmem ...` (same as the `csi-pmem` entry point)."""

from csi_pmem.cli import main

raise SystemExit(main())
