"""``python -m dspx.cli``: the ``dspx`` command."""
from . import main

main()
