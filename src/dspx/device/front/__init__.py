"""The device front: one process owning the listening socket, every
connection and the channels to the cores."""
