"""`python -m belayer.workers.sandbox`: run this host's sandbox worker until SIGTERM."""

import sys

from belayer.workers.sandbox.worker import main

sys.exit(main(sys.argv[1:]))
