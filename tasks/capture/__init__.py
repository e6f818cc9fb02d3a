"""Hidden states out of SGLang: the hook inside the server, the dump
contract, the client that reads captures back by rid, and extraction."""
