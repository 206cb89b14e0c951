"""The simulated DSP.  Nothing on the host side imports this package; hosts
start it as a process (``python -m dspx.device`` / ``dspx serve``)."""
