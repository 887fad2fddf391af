"""``python -m spark SNAPSHOT_DIR [--out DIR] [--master URL]``: the analytics job (spark/analytics.py)."""

import sys

from fencemq.spark.analytics import main

sys.exit(main())
