#!/bin/sh
# UML's slirp transport hands slirp a socketpair, but Debian's classic slirp exits unless
# its stdin is a terminal: give it a pty through socat. slirp-fullbolt has no baud limit.
exec socat -b65536 STDIO EXEC:/usr/bin/slirp-fullbolt,pty,rawer,echo=0
