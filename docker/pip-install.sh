#!/bin/sh
# pip install "$@": from the wheels in docker/wheels/ alone when the build context brings some (a build with no
# network, as CI does it: the host fills the folder), else from the package indexes.
set -eu
if ls /wheels/*.whl >/dev/null 2>&1; then
    exec pip install --no-index --find-links /wheels "$@"
fi
exec pip install "$@"
