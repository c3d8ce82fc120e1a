"""Helpers shared by the test modules, one module per job: :mod:`.data` (quadrant images and their label maps, map
stores of given rows), :mod:`.processes` (running a console command, an upstream tool or a subprocess as a user
would), :mod:`.observers` (observers for the methods' ``observing`` scopes); the repository's root here."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
