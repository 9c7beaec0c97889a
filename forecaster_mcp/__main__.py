import sys

from forecaster_mcp.cli import main

sys.exit(main())
