"""``sglang.lang.chat_template``: role prefixes and suffixes."""
from ..chat_template import ChatTemplate  # noqa: F401
