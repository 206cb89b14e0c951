"""``python -m dspx.device.core``: one simulated DSP core (started by the front)."""
from .worker import main

main()
