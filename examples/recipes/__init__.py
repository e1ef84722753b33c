"""What the two HTTP gateway recipes share (``examples/asgi_gateway.py`` and
``examples/wsgi_gateway.py``): the configuration (:mod:`.config`), the screen every request
passes before the library sees it (:mod:`.screen`), where a request goes (:mod:`.routing`),
the forward to the holder (:mod:`.forward`), the fenced effect table (:mod:`.ledger`) and
the command line with its JSON lines of output (:mod:`.command`).
None of it depends on the web framework, so both gateways route, refuse and write alike."""
