"""The one error type a user can cause; the CLI prints its message and exits with 2."""


class FicocoError(ValueError):
    """A mistake in the user's input (bad flag, unknown model, impossible budget, missing file).

    The message is one line that says what is wrong and what to do instead.
    """
