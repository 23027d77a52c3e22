"""nbdkit entry point: `nbdkit python /abs/path/plugin.py data=... hash=... root-hash=...`.

It finds the nbd_verity package through PYTHONPATH (set it to this folder, or install the
package); the callbacks themselves live in nbd_verity/serve/callbacks.py.
"""

from nbd_verity.serve.callbacks import *  # noqa: F403  (the callbacks nbdkit looks up)
