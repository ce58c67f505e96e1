"""Which torch operators run on the calling thread."""

from torch.utils._python_dispatch import TorchDispatchMode


class ThreadOps(TorchDispatchMode):
    """Inside `with ThreadOps() as ops:`, every torch operator dispatched on this thread is named in `ops.ops`
    (the mode is the thread's own: other threads' operators are not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
