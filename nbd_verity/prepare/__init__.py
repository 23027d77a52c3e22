"""From options to an opened, trusted, checked image: what runs before nbdkit serves."""
