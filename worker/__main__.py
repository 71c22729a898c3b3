"""`python -m worker`: the image's command (see worker.handler for the modes)."""
import sys

from worker.handler import main

sys.exit(main())
