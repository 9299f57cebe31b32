import sys

from kvcache_server.cli import main

sys.exit(main())
