"""A reference bridge between copier-node and MetaTrader 5 terminals.

It serves copier-node's bridge protocol (docs/design/bridge-protocol.md) over TCP and carries
each request out on the terminal of the request's login, through MetaQuotes' `MetaTrader5`
Python package: one worker process per terminal, the event stream made by polling.
"""

__version__ = "0.1.0"
