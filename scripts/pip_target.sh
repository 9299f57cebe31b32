# Sourced by scripts/install_*_cpu.sh (not run): resolves where they install. With TARGET set to a
# virtual environment's folder or to a pip command ("python3 -m pip", /path/to/bin/pip) and NAME to
# the script's name for messages, it sets PYTHON (the interpreter behind that pip, for the scripts'
# import checks) and PIP (the command), and defines
#   pip ARGS...              that pip, without its version check;
#   installed_version PKG    the installed version of PKG, "" when it is missing (never an error
#                            under `set -euo pipefail`).
if [ -d "$TARGET" ]; then
  [ -x "$TARGET/bin/python" ] || { echo "$NAME: $TARGET is not a virtual environment" >&2; exit 2; }
  PYTHON="$TARGET/bin/python"
  PIP=("$PYTHON" -m pip)
else
  read -r -a PIP <<<"$TARGET"
  # The interpreter behind the pip command: "X -m pip" or ".../bin/pip".
  if [ "${#PIP[@]}" -ge 3 ] && [ "${PIP[1]}" = "-m" ] && [ "${PIP[2]}" = "pip" ]; then
    PYTHON=${PIP[0]}
  else
    PYTHON="$(dirname "$(command -v "${PIP[0]}")")/python"
  fi
fi
pip() { "${PIP[@]}" --disable-pip-version-check "$@"; }
installed_version() { pip show "$1" 2>/dev/null | sed -n 's/^Version: //p' || true; }
