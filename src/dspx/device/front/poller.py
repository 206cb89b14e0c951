"""The front's one epoll: which file descriptor wakes which callback."""
from __future__ import annotations

import select

IN, OUT = int(select.EPOLLIN), int(select.EPOLLOUT)


class Poller:
    def __init__(self):
        self.epoll = select.epoll()
        self.watch: dict[int, tuple] = {}  # fd -> (callback, arg)

    def register(self, fd: int, callback, arg, events: int = IN) -> None:
        """``callback(arg, events)`` runs when ``fd`` is ready for ``events``."""
        self.watch[fd] = (callback, arg)
        self.epoll.register(fd, events)

    def unregister(self, fd: int) -> None:
        if self.watch.pop(fd, None) is not None:
            try:
                self.epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    def modify(self, fd: int, events: int) -> None:
        try:
            self.epoll.modify(fd, events)
        except (OSError, ValueError):
            pass
