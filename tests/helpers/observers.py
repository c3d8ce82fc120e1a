"""Observers for the methods' ``observing`` scopes: keep what each block decided, for a test to read."""


def record_into(record: dict):
    """A TokenMixup observer (``TokenMixupHooks.observing``) that keeps each HTM block's saliency ``(B, N)``, easy
    rows and difficulty in ``record[index]``."""

    def observe(idx, saliency, easy, difficulty):
        record[idx] = dict(saliency=saliency, easy=easy, difficulty=difficulty)

    return observe
