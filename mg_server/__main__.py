import sys

from mg_server.cli import main

if __name__ == "__main__":
    sys.exit(main())
