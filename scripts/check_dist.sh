#!/usr/bin/env bash
# The sdist and wheel in DIST (default dist/), checked as a user gets them: twine's metadata
# check (README.md as the long description), the files each must carry, then the wheel
# installed into a clean venv (no editable install, no checkout on sys.path: run from a
# temporary folder) running the quickstart (examples/quickstart.py, taken from the sdist)
# and the library's migrations (sqla-proletarian install) on SQLite.
# Usage: scripts/check_dist.sh [DIST]; PYTHON picks the venv's interpreter (python3), TWINE
# twine, PIP the pip (22.3 or newer) that installs into the venv from outside it, which spares
# the venv a pip of its own.
set -euo pipefail
dist=$(cd "${1:-dist}" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
twine=${TWINE:-twine}
pip=${PIP:-pip}
shopt -s nullglob
wheels=("$dist"/sqla_proletarian-*.whl)
sdists=("$dist"/sqla_proletarian-*.tar.gz)
if [ ${#wheels[@]} != 1 ] || [ ${#sdists[@]} != 1 ]; then
    echo "check_dist: $dist must hold one wheel and one sdist (make dist builds them)" >&2
    exit 1
fi
"$twine" check --strict "${wheels[0]}" "${sdists[0]}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# What each archive must carry; the sdist's quickstart is copied out to be run below.
"$python" - "${wheels[0]}" "${sdists[0]}" "$work" "$root" <<'PY'
import sys
import tarfile
import zipfile
from pathlib import Path

wheel, sdist, work, root = sys.argv[1:]
in_wheel = set(zipfile.ZipFile(wheel).namelist())
with tarfile.open(sdist) as tar:
    in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    quickstart = next(m for m in tar.getmembers() if m.name.endswith("/examples/quickstart.py"))
    Path(work, "quickstart.py").write_bytes(tar.extractfile(quickstart).read())
wanted = {
    "wheel": (in_wheel, [
        "sqla_proletarian/py.typed",
        "sqla_proletarian/migrations/versions/sqlap_0001_create_tables.py",
        "sqla_proletarian/dashboard/templates/base.html",
        "sqla_proletarian/dashboard/static/dashboard.js",
    ]),
    "sdist": (in_sdist, [
        "pyproject.toml", "README.md", "alembic.ini", "alembic/env.py",
        "alembic/script.py.mako", "docs/index.md", "mkdocs.yml", "examples/quickstart.py",
        "sqla_proletarian/migrations/versions/sqlap_0001_create_tables.py",
        "sqla_proletarian/dashboard/static/dashboard.js",
    ]),
}
missing = [f"{kind}: {name}" for kind, (names, paths) in wanted.items()
           for name in paths if name not in names]
revisions = [f"sqla_proletarian/migrations/versions/{path.name}"
             for path in Path(root, "sqla_proletarian/migrations/versions").glob("sqlap_*.py")]
missing += [f"{kind}: {name}" for kind, (names, _) in wanted.items()
            for name in revisions if name not in names]
if missing:
    sys.exit("check_dist: missing from the archives:\n  " + "\n  ".join(missing))
PY

"$python" -m venv --without-pip "$work/venv"
"$pip" --python "$work/venv/bin/python" install -q --disable-pip-version-check "${wheels[0]}"
cd "$work"
venv/bin/python -c 'import sqla_proletarian as sp, sys
assert sp.__file__.startswith(sys.prefix), f"imported from {sp.__file__}, not the venv"'
venv/bin/python quickstart.py > quickstart.out || { cat quickstart.out; exit 1; }
grep -q "Bob's rolled-back job: never ran" quickstart.out || { cat quickstart.out; exit 1; }
venv/bin/sqla-proletarian install --url sqlite:///installed.db
echo "check_dist: $(basename "${wheels[0]}") installs and runs the quickstart from a clean venv"
