"""``python -m ucm``: the ``ucm`` command."""

from ucm.cli import main

main()
