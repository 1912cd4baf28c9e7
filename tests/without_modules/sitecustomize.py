"""Makes the modules named in MINGPT_TEST_WITHOUT (comma-separated) look uninstalled.

Put this directory on PYTHONPATH: ``sys.modules[name] = None`` makes ``import name`` fail and
``importlib.util.find_spec(name)`` return None, as on a machine without that package.
"""
import os
import sys

for _name in filter(None, os.environ.get("MINGPT_TEST_WITHOUT", "").split(",")):
    sys.modules[_name] = None
