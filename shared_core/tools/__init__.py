"""Tools, not algorithms: the synthetic world generator (:mod:`.world`, console script ``tokenaug-data``) that the
tests, the demo and the world configs train on. Framework-free like the rest of :mod:`shared_core`."""
