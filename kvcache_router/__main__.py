import sys

from kvcache_router.cli import main

sys.exit(main())
