import sys

from distlab.cli import main

sys.exit(main())
