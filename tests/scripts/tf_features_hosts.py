"""is_homogeneous on this rank, from the torch face and the TensorFlow face; writes ``rank<R>.json``.

Run on namespace hosts (``tests/netns.py``) with ``ringpipe launch --nnodes``; the folder to write
into is the argument.
"""

import json
import os
import socket
import sys

import ringpipe
import ringpipe.tensorflow as hvd


def main(out_dir):
    hvd.init()
    out = {"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(), "tf": hvd.is_homogeneous(),
           "api": ringpipe.is_homogeneous(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{out['rank']}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
