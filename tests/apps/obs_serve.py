"""The HTTP child, as a process of its own for the tests:
python -m tests.apps.obs_serve BIND PORT DATABASE_URL RUNTIME_DIR MULTIPROC_DIR APPLICATION_NAME"""

import logging
import sys
from pathlib import Path

from supervisor import http_server

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    bind, port, database_url, runtime_dir, multiproc_dir, application_name = sys.argv[1:]
    http_server.serve(bind, int(port), database_url, Path(runtime_dir), Path(multiproc_dir),
                      application_name=application_name)
