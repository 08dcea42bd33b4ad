"""Poor man's configurator (after nanoGPT): exec'd by train.py / sample.py / bench.py / prepare_data.py.
`python train.py config/some_file.py --batch_size=32`: config files are exec'd, then --key=value overrides are
literal_eval'd; every key must be an existing default global of the script and keep its type, else ValueError."""
import sys
import types
from ast import literal_eval


def _cfg_keys():  # the script's config defaults: lowercase globals holding a bool/int/float/str/tuple/list
    return {k: v for k, v in list(globals().items())
            if k == k.lower() and not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple, list))}


def _cfg_set(key, val, origin):
    if key not in _cfg_keys():
        raise ValueError(f"unknown config key {key!r} (from {origin}); expected one of {sorted(_cfg_keys())}")
    old = globals()[key]
    if type(old) is float and type(val) is int:  # --lr=1 means 1.0
        val = float(val)
    if type(val) is not type(old):
        raise ValueError(f"config key {key!r} (from {origin}) must be {type(old).__name__} like its default "
                         f"{old!r}, got {type(val).__name__} {val!r}")
    print(f"Overriding: {key} = {val!r}")
    globals()[key] = val


for _arg in sys.argv[1:]:
    if _arg in ("-h", "--help"):
        print(f"usage: python {sys.argv[0]} [config/file.py ...] [--key=value ...]; keys and defaults:")
        for _k, _v in _cfg_keys().items():
            print(f"  --{_k}={_v!r}")
        sys.exit(0)
    elif not _arg.startswith("--"):  # a config file: plain assignments, exec'd against the current values
        print(f"Overriding config with {_arg}")
        _scope = dict(globals())
        with open(_arg) as _f:
            exec(_f.read(), _scope)
        for _k, _v in _scope.items():
            if not _k.startswith("_") and not isinstance(_v, types.ModuleType) and _v is not globals().get(_k):
                _cfg_set(_k, _v, _arg)
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
