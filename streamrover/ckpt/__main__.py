"""``python -m streamrover.ckpt --address ADDR``: run a checkpoint saver (see :mod:`streamrover.ckpt.saver`)."""

import sys

from streamrover.ckpt.saver import main

sys.exit(main())
