"""Where image bytes come from: local files and block devices, NBD URIs, and the captive
nbdkit upstreams (curl, S3, nbd) that serve remote images."""
