"""Emission: graph + plan -> one standalone, black-formatted, compile-checked Python training program."""

from axgen.codegen.emit import EmitError, emit

__all__ = ["EmitError", "emit"]
