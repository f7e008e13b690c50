"""What a compile child (``pockengine.step.child``) reports to its parent, as JSON.

``capture(work)`` runs ``work()`` in the child and records, in the order they happened,
the warnings it emitted and the ``logging`` records its loggers created (the child's
copies of the parent's log handlers are removed first, so nothing is written twice), and
the exception it raised. In the parent, ``replay`` emits the warnings again (same
category, message, file and line: ``pytest.warns`` and warning filters see them as if
the compile ran here) and hands the log records to the same loggers; ``raise_error``
raises the child's error: an engine error (``PockEngineError``) as the same class with
the same message and attributes, any other exception as a ``CompileError`` naming its
type, with the child's traceback as a note.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from pockengine.ir import CompileError, PockEngineError

__all__ = ["Relay", "capture", "raise_error", "replay"]

Event = tuple[str, dict[str, Any]]  # ("warning" | "log", its fields)
T = TypeVar("T")


@dataclass
class Relay:
    """A child's report: its warnings and log records in order, and its error (or None)."""

    events: list[Event] = field(default_factory=list)
    error: dict[str, Any] | None = None
    kept: list[Any] = field(default_factory=list, repr=False)  # see ``capture``

    def to_json(self) -> dict[str, Any]:
        return {"events": [list(e) for e in self.events], "error": self.error}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Relay:
        return cls([(str(kind), dict(fields)) for kind, fields in data["events"]], data["error"])


class _Collect(logging.Handler):
    def __init__(self, events: list[Event]) -> None:
        super().__init__(logging.NOTSET)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        fields = {"name": record.name, "levelno": record.levelno, "message": message,
                  "pathname": record.pathname, "lineno": record.lineno,
                  "funcName": record.funcName}  # fmt: skip
        self.events.append(("log", fields))


def capture(work: Callable[[], None]) -> Relay:
    """``work()`` with its warnings, log records and exception recorded (the child's side;
    it changes this process's log handlers for good)."""
    relay = Relay()
    manager = logging.Logger.manager
    loggers = [logging.getLogger(), *(lg for lg in manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]  # fmt: skip
    # the handlers are kept, not freed: the child frees none of the parent's objects
    # (what they hold, say a test's log records, may have destructors unsafe after a fork)
    relay.kept = [(logger, logger.handlers) for logger in loggers]
    for logger in loggers:
        logger.handlers = []
    logging.getLogger().addHandler(_Collect(relay.events))

    def record_warning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        relay.events.append(
            (
                "warning",
                {
                    "module": category.__module__,
                    "name": category.__qualname__,
                    "message": str(message),
                    "filename": filename,
                    "lineno": lineno,
                },
            )
        )

    with warnings.catch_warnings():
        warnings.showwarning = record_warning
        try:
            work()
        except BaseException as exc:  # reported to the parent, which raises it
            relay.error = _describe(exc)
    return relay


def _describe(exc: BaseException) -> dict[str, Any]:
    attrs = {}
    for key, value in vars(exc).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        attrs[key] = value
    return {"module": type(exc).__module__, "name": type(exc).__qualname__,
            "message": str(exc), "attrs": attrs,
            "traceback": "".join(traceback.format_exception(exc))}  # fmt: skip


def replay(relay: Relay) -> None:
    """Emit the child's warnings and log records here, in their order."""
    for kind, fields in relay.events:
        if kind == "warning":
            category = _find_class(fields["module"], fields["name"], Warning) or UserWarning
            warnings.warn_explicit(
                fields["message"], category, fields["filename"], int(fields["lineno"])
            )
            continue
        record = logging.makeLogRecord(
            {
                "name": fields["name"],
                "levelno": fields["levelno"],
                "levelname": logging.getLevelName(fields["levelno"]),
                "msg": fields["message"],
                "args": None,
                "pathname": fields["pathname"],
                "lineno": fields["lineno"],
                "funcName": fields["funcName"],
            }
        )
        logging.getLogger(fields["name"]).handle(record)


def raise_error(error: dict[str, Any]) -> NoReturn:
    """Raise the child's ``error`` here (module doc)."""
    cls = _find_class(error["module"], error["name"], PockEngineError)
    if cls is None:
        exc: BaseException = CompileError(
            f"compiling in a child process failed: {error['name']}: {error['message']}"
        )
        exc.add_note("the compile child's traceback:\n" + error["traceback"].rstrip())
        raise exc
    exc = cls.__new__(cls)
    Exception.__init__(exc, error["message"])  # its own __init__ may take other arguments
    for key, value in error["attrs"].items():
        setattr(exc, key, _tuples(value))
    raise exc


def _tuples(value: Any) -> Any:
    """JSON's lists of lists back as lists of tuples (``UnsupportedOpError.entries``)."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [tuple(v) for v in value]
    return value


def _find_class(module: str, qualname: str, base: type[T]) -> type[T] | None:
    """The class ``module.qualname`` if it is a subclass of ``base``; the module must be
    loaded here already, or be one of PockEngine's."""
    found: Any = sys.modules.get(module)
    if found is None and module.startswith("pockengine."):
        try:
            found = importlib.import_module(module)
        except ImportError:
            return None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, base) else None
