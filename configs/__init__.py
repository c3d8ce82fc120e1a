"""tokenaug's configs, installed as the package ``tokenaug_configs`` (data only: nothing here is imported).

``tokenaug-config list | path NAME | copy NAME DEST`` (:mod:`shared_core.configs`) finds and copies them.
"""
