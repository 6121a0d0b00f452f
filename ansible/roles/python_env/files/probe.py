"""Print the environment's Python, Ray, Horovod and the pins it does not satisfy, as JSON.

usage: <venv>/bin/python probe.py '["torch==2.14.1", "ray[default,train]==2.60.0", ...]'
(roles/python_env runs it on each node.)
"""
import json
import sys
from importlib import metadata


def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


missing = []
for pin in json.loads(sys.argv[1]):
    name, _, want = pin.partition("==")
    have = version(name.split("[")[0])
    if have != want:
        missing.append(f"{pin} (have {have})")
print(json.dumps({"python": "{}.{}".format(*sys.version_info[:2]), "ray": version("ray"),
                  "horovod": version("horovod"), "missing": missing}))
