"""A worked connector adapter: send fenced command lines to a tmux pane.

tmux is one of the seed's connector kinds and one that runs anywhere Debian's ``tmux``
package does. :class:`TmuxPaneAdapter` sends a command only when called with a validated
:class:`~mos_lease.context.ConnectorExecutionContext`, stamps it with the fencing token
(``export MOS_FENCE=<token>; <command>``), and asks a
:class:`~mos_lease.fencing.ResourceGuard` keyed by the pane first, so a connector whose
epoch is older than one the pane has already seen never reaches it.
"""

from mos_lease_tmux.adapter import TmuxPaneAdapter, TmuxSendResult, check_command, stamp
from mos_lease_tmux.server import TmuxError, TmuxServer

__all__ = [
    "TmuxError",
    "TmuxPaneAdapter",
    "TmuxSendResult",
    "TmuxServer",
    "check_command",
    "stamp",
]
