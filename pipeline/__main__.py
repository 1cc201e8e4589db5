import sys

from pipeline.shell.cli import main

sys.exit(main())
