"""The numbers attach speaks: the kernel's nbd netlink family and the NBD protocol.

Kernel side from include/uapi/linux/nbd-netlink.h and linux/nbd.h (tests compare them with
the headers Debian installs); protocol side from the NBD protocol's proto.md.
"""

# -- generic netlink (linux/netlink.h, linux/genetlink.h) ----------------------------
NETLINK_GENERIC = 16
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLMSG_ERROR = 0x2
NLMSG_DONE = 0x3
NLA_F_NESTED = 0x8000
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
CTRL_ATTR_MCAST_GROUPS = 7
CTRL_ATTR_MCAST_GRP_NAME = 1
CTRL_ATTR_MCAST_GRP_ID = 2

# -- the nbd family (linux/nbd-netlink.h) ---------------------------------------------
NBD_GENL_FAMILY_NAME = "nbd"
NBD_GENL_VERSION = 0x1
NBD_GENL_MCAST_GROUP_NAME = "nbd_mc_group"

NBD_ATTR_INDEX = 1                # u32
NBD_ATTR_SIZE_BYTES = 2           # u64
NBD_ATTR_BLOCK_SIZE_BYTES = 3     # u64
NBD_ATTR_TIMEOUT = 4              # u64, seconds: a request this old marks its link dead
NBD_ATTR_SERVER_FLAGS = 5         # u64, the export's transmission flags
NBD_ATTR_CLIENT_FLAGS = 6         # u64, NBD_CFLAG_*
NBD_ATTR_SOCKETS = 7              # nested NBD_SOCK_ITEMs
NBD_ATTR_DEAD_CONN_TIMEOUT = 8    # u64, seconds new requests wait for a live link
NBD_ATTR_DEVICE_LIST = 9          # nested NBD_DEVICE_ITEMs (STATUS reply)
NBD_ATTR_BACKEND_IDENTIFIER = 10  # string, shown in /sys/block/nbdX/backend

NBD_DEVICE_ITEM = 1
NBD_DEVICE_INDEX = 1
NBD_DEVICE_CONNECTED = 2
NBD_SOCK_ITEM = 1
NBD_SOCK_FD = 1

NBD_CMD_CONNECT = 1
NBD_CMD_DISCONNECT = 2
NBD_CMD_RECONFIGURE = 3
NBD_CMD_LINK_DEAD = 4
NBD_CMD_STATUS = 5

# -- transmission flags (linux/nbd.h, proto.md) ---------------------------------------
NBD_FLAG_HAS_FLAGS = 1 << 0
NBD_FLAG_READ_ONLY = 1 << 1
NBD_FLAG_CAN_MULTI_CONN = 1 << 8

# -- the NBD handshake (proto.md, "Fixed newstyle negotiation") -----------------------
NBDMAGIC = 0x4E42444D41474943  # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054  # "IHAVEOPT"
OPT_REPLY_MAGIC = 0x0003E889045565A9
NBD_FLAG_FIXED_NEWSTYLE = 1 << 0
NBD_FLAG_NO_ZEROES = 1 << 1
NBD_FLAG_C_FIXED_NEWSTYLE = 1 << 0
NBD_FLAG_C_NO_ZEROES = 1 << 1
NBD_OPT_ABORT = 2
NBD_OPT_STARTTLS = 5
NBD_OPT_GO = 7
NBD_REP_ACK = 1
NBD_REP_INFO = 3
NBD_REP_FLAG_ERROR = 1 << 31
NBD_INFO_EXPORT = 0
NBD_INFO_DESCRIPTION = 2
NBD_INFO_BLOCK_SIZE = 3
NBD_REQUEST_MAGIC = 0x25609513
NBD_CMD_DISC = 2

# Option errors by name, for one clear line (proto.md, "Option reply types").
REP_ERRORS = {
    NBD_REP_FLAG_ERROR | 1: "option not supported",
    NBD_REP_FLAG_ERROR | 2: "refused by the server's policy",
    NBD_REP_FLAG_ERROR | 3: "invalid option",
    NBD_REP_FLAG_ERROR | 4: "not supported on this platform",
    NBD_REP_FLAG_ERROR | 5: "the server requires TLS",
    NBD_REP_FLAG_ERROR | 6: "no such export",
    NBD_REP_FLAG_ERROR | 7: "the server is shutting down",
    NBD_REP_FLAG_ERROR | 8: "the server requires block size negotiation",
    NBD_REP_FLAG_ERROR | 9: "request too big",
}
