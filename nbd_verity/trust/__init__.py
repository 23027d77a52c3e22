"""Where trust in a root hash comes from: pinned, or found beside the image and signed.

certs.py loads the trusted certificates (systemd's verity.d places); signature.py checks
a PKCS#7 signature over the hex root hash as the kernel and systemd do; signing.py makes
one; sidecar.py finds IMAGE.roothash, IMAGE.roothash.p7s, IMAGE.verity and verity.sig as
systemd-dissect does; root.py puts them together for the server and the CLI
(resolve_root). Nothing here is on the read path: it all runs once, at start-up.
"""
