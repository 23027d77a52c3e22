"""The kernel's NBD client, kept attached: `nbd-verity attach` and `detach`.

A device set up over generic netlink (not ioctls) can lose its connection and get a new
one without failing a read: the kernel queues new requests while the link is dead
(NBD_ATTR_DEAD_CONN_TIMEOUT), says so on its multicast group (NBD_CMD_LINK_DEAD), and
takes a new, already negotiated socket (NBD_CMD_RECONFIGURE). This room holds that client:
- uapi.py: the kernel's numbers (linux/nbd-netlink.h, linux/nbd.h) and the NBD protocol's;
- genl.py: generic netlink over Python's own AF_NETLINK socket (messages built in one place);
- kernel.py: the nbd family's commands, its events, and the device's sysfs files;
- handshake.py: an NBD URI, and the fixed-newstyle negotiation that hands back a socket in
  the transmission phase with what the server said of its export (size, flags, root hash);
- identity.py: the image a device shows (root hash, size), kept in its backend identifier;
- session.py: one attached device: connect, adopt, and the reconnect loop that LINK_DEAD
  drives;
- status.py: the state file a running attach keeps, `attach --list`, `detach`, sd_notify.
It imports nothing of the server: a client of any nbd-verity server, local or remote.
"""
