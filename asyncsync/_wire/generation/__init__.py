"""Token-in-token-out on the wire, by job: `options` (the public option types, their
validation, the prompt checks), `bodies` (request bodies, the answers' parsers, the
completing and re-tokenize steps), `stream` (a streamed answer assembled). Pure, no I/O;
this file imports nothing."""
