"""Poor man's configurator (after nanoGPT): exec'd by train.py / sample.py / bench.py / prepare_data.py.
`python train.py config/some_file.py --batch_size=32`: config files are exec'd, then --key=value overrides are
literal_eval'd; every key must be an existing default global of the script and keep its type, else ValueError.
_overrides records what was set ({key: origin}); check_choice(key=options) checks a setting against its options.
A ValueError raised by this repo's code is a user error: the script ends with its message as one line `error: ...`
and exit status 1; any other exception keeps its traceback."""
import builtins
import difflib
import os
import sys
import traceback
import types
from ast import literal_eval


def _user_error_hook(kind, err, tb, _default=sys.excepthook,
                     _repo=os.path.dirname(os.path.abspath(globals().get("__file__", sys.argv[0])))):
    """sys.excepthook: one line for a ValueError raised in a file of this repo, else the traceback."""
    last = tb
    while last.tb_next is not None:
        last = last.tb_next
    where = os.path.abspath(last.tb_frame.f_globals.get("__file__") or "?")
    if issubclass(kind, ValueError) and os.path.dirname(where) == _repo:
        print(f"error: {err}", file=sys.stderr)
    else:
        _default(kind, err, tb)


if __name__ == "__main__":  # the running script (not a test that execs this file)
    sys.excepthook = _user_error_hook
_overrides = {}


def _cfg_keys():  # the script's config defaults: lowercase globals holding a bool/int/float/str/tuple/list
    return {k: v for k, v in list(globals().items())
            if k == k.lower() and not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple, list))}


def _cfg_set(key, val, origin):
    if key not in _cfg_keys():
        near = difflib.get_close_matches(key, _cfg_keys(), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ValueError(f"unknown config key {key!r} (from {origin}); {hint}`python {sys.argv[0]} --help` lists them")
    old = globals()[key]
    if type(old) is float and type(val) is int:  # --lr=1 means 1.0
        val = float(val)
    if type(val) is not type(old):
        raise ValueError(f"config key {key!r} (from {origin}) must be {type(old).__name__} like its default "
                         f"{old!r}, got {type(val).__name__} {val!r}")
    globals()[key] = val
    _overrides.pop(key, None)
    _overrides[key] = origin  # in the order set


def check_choice(**options):
    """For the scripts' own checks: each named setting must hold one of its options, else a ValueError such as
    "dtype must be 'bfloat16', 'float16' or 'float32', got 'fp8'"."""
    for key, allowed in options.items():
        if globals()[key] not in allowed:
            names = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
            raise ValueError(f"{key} must be {names}, got {globals()[key]!r}")


for _arg in sys.argv[1:]:
    if _arg in ("-h", "--help"):
        print(f"usage: python {sys.argv[0]} [config/file.py ...] [--key=value ...]; keys and defaults:")
        for _k, _v in _cfg_keys().items():
            print(f"  --{_k}={_v!r}")
        sys.exit(0)
    elif not _arg.startswith("--"):  # a config file: plain assignments, exec'd against the current values
        if not os.path.isfile(_arg):
            raise ValueError(f"no such config file {_arg!r} (arguments are config files or --key=value)")
        _scope = dict(globals())
        try:  # a config file is the user's: what goes wrong in it is their error, told with its line
            with open(_arg, encoding="utf-8") as _f:
                exec(builtins.compile(_f.read(), _arg, "exec"), _scope)  # the script may have a `compile` setting
        except Exception as _e:
            _line = _e.lineno if isinstance(_e, SyntaxError) else next(
                (_fr.lineno for _fr in reversed(traceback.extract_tb(_e.__traceback__)) if _fr.filename == _arg), None)
            _what = _e.msg if isinstance(_e, SyntaxError) else str(_e)
            raise ValueError(f"config file {_arg}" + (f", line {_line}" if _line else "")
                             + f": {type(_e).__name__}: {_what}") from None
        _set = [_k for _k, _v in _scope.items()
                if not _k.startswith("_") and not isinstance(_v, types.ModuleType) and _v is not globals().get(_k)]
        if not _set:
            raise ValueError(f"config file {_arg} sets no config key: it is run as Python, `key = value` lines")
        for _k in _set:
            _cfg_set(_k, _scope[_k], _arg)
        print(f"Overriding config with {_arg} ({len(_set)} keys)")
    elif "=" in _arg:
        _k, _raw = _arg[2:].split("=", 1)
        try:
            _v = literal_eval(_raw)
        except (SyntaxError, ValueError):
            _v = _raw  # a bare string
        if isinstance(globals().get(_k), str) and not isinstance(_v, str):
            _v = _raw  # --out_dir=123 stays a string
        _cfg_set(_k, _v, _arg)
    else:
        raise ValueError(f"argument {_arg!r} must be --key=value or a config file path")
_cli = [_k for _k, _o in _overrides.items() if _o.startswith("--")]
if _cli:
    print("Overriding: " + ", ".join(f"{_k}={globals()[_k]!r}" for _k in _cli))
