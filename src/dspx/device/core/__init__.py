"""A simulated DSP core: the loader, inference, the kernel library, custom
operators and their runtime.  Each core is its own process
(``python -m dspx.device.core``), fed by the front over a socketpair."""
