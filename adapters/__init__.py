"""Built-in model families. Importing this package registers them."""

from looped_spec.adapters.huginn import HuginnAdapter
from looped_spec.adapters.nanbeige import NanbeigeAdapter
from looped_spec.adapters.ouro import OuroAdapter

__all__ = ["HuginnAdapter", "NanbeigeAdapter", "OuroAdapter"]
