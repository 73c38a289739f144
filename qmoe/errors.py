"""Errors qmoe raises at its public boundary."""


class UnsupportedError(RuntimeError):
    """A recipe, op or path that this device or backend cannot run.

    The message names the op, the recipe, the device and the way out, e.g.
    ``grouped_path="split"`` or ``QMOE_BACKEND=reference``.
    """

    def __init__(self, op: str, *, recipe=None, device=None, why: str = "", fix: str = ""):
        self.op, self.recipe, self.device = op, recipe, device
        parts = [f"{op} is not supported"]
        if recipe is not None:
            parts.append(f"for recipe {type(recipe).__name__ if not isinstance(recipe, str) else recipe}")
        if device is not None:
            parts.append(f"on device {device}")
        msg = " ".join(parts)
        if why:
            msg += f": {why}"
        if fix:
            msg += f". Way out: {fix}"
        super().__init__(msg)
