"""`csi-pmem volume ...`: a CSI client over the driver's socket and what it prints.

Why apart from the driver: it runs anywhere the driver's socket is reachable and never
imports the driver's code, only the generated CSI stubs.
"""
