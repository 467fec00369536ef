"""Back ends: where namespaces are carved. Servicers import only :mod:`.base`."""
