"""`python -m genie_daemon` is `genie-daemon`."""
from .entry import main

main()
