"""`python -m belayer.workers.sandbox`: run this host's sandbox worker until SIGTERM."""

import sys

from belayer.workers.runner import main
from belayer.workers.sandbox.worker import able_host, banner, serve

sys.exit(main(serve, banner, hold=able_host))
