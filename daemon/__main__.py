"""`python -m genie_daemon` is `genie-daemon`."""
from .cli import main

main()
