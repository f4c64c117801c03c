"""Chat templates in one place: rendering and tool conversations (chat.py), the artifact's
template in the runtime (artifact.py), and the sandbox that bounds a template's render
(sandbox/)."""
