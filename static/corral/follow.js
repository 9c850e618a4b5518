// The session page follows the conversation (docs/live-page.md, "Following the conversation").
//
// It opens at its latest message with the message box in view (or at the card a link names:
// a notification opens /sessions/<id>/#tool-<call id>). While the reader is at the bottom,
// whatever the transcript or the queue gains keeps them there; once they scroll up the page
// stays where they are and a "↓ new messages" button appears instead, which brings them back.
(function () {
  "use strict";
  const root = document.getElementById("session");
  const transcript = document.getElementById("transcript");
  if (!root || !transcript) return;
  const SLACK = 48;  // pixels from the bottom that still count as "at the bottom"
  let following = true;
  let earlier = false;  // "Show earlier turns" is adding rows above: nothing new
  if ("scrollRestoration" in history) history.scrollRestoration = "manual";

  const button = document.createElement("button");
  button.type = "button";
  button.id = "new-messages";
  button.className = "new-messages";
  button.hidden = true;
  button.textContent = "\u2193 new messages";
  root.appendChild(button);

  function atBottom() {
    return window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - SLACK;
  }
  function toBottom() {
    window.scrollTo(0, document.documentElement.scrollHeight);
    following = true;
    button.hidden = true;
  }
  function open() {
    const named = location.hash.length > 1 && document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (named) {
      named.scrollIntoView({ block: "center" });
      following = atBottom();
    } else {
      toBottom();
    }
  }

  window.addEventListener("scroll", function () {
    following = atBottom();
    if (following) button.hidden = true;
  }, { passive: true });
  // A phone's keyboard opening, a rotated screen: the bottom stays the bottom.
  window.addEventListener("resize", function () { if (following) toBottom(); });
  button.addEventListener("click", toBottom);

  document.body.addEventListener("htmx:beforeSwap", function (e) {
    if (e.detail.target && e.detail.target.id && e.detail.target.id.indexOf("earlier-") === 0) earlier = true;
  });
  document.body.addEventListener("htmx:afterSettle", function () { earlier = false; });

  function grew() {
    if (earlier) return;
    if (following) toBottom();
    else button.hidden = false;
  }
  const watch = new MutationObserver(grew);
  const options = { childList: true, subtree: true, characterData: true };
  watch.observe(transcript, options);
  const queue = document.getElementById("queue");
  if (queue) watch.observe(queue, options);

  open();
  // Images and fonts may still change the height: at the bottom it stays at the bottom.
  window.addEventListener("load", function () { if (following) toBottom(); });
})();
