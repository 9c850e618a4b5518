// The notifications page (docs/attention.md): this browser's switches (kept in localStorage,
// read by attention.js) and its Web Push subscription (sent to the server, listed below it).
(function () {
  "use strict";
  const root = document.getElementById("notifications");
  if (!root) return;
  const notifySwitch = document.getElementById("notify-switch");
  const soundSwitch = document.getElementById("sound-switch");
  const notifyFeedback = document.getElementById("notify-feedback");
  const pushFeedback = document.getElementById("push-feedback");

  function get(name) { try { return localStorage.getItem("corral." + name) === "on"; } catch (e) { return false; } }
  function set(name, on) { try { localStorage.setItem("corral." + name, on ? "on" : "off"); } catch (e) { /* private mode */ } }

  function csrfToken() {
    try { return JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRFToken"]; } catch (e) { return ""; }
  }

  notifySwitch.checked = get("notify") && window.Notification && Notification.permission === "granted";
  soundSwitch.checked = get("sound");
  if (!window.Notification) {
    notifySwitch.disabled = true;
    notifyFeedback.textContent = "This browser cannot show system notifications.";
  }

  notifySwitch.addEventListener("change", function () {
    if (!notifySwitch.checked) { set("notify", false); notifyFeedback.textContent = ""; return; }
    Notification.requestPermission().then(function (permission) {
      const granted = permission === "granted";
      set("notify", granted);
      notifySwitch.checked = granted;
      notifyFeedback.textContent = granted ? "This browser will show a notification for each new question."
        : "The browser refused: allow notifications for this site in its settings, then turn this on again.";
    });
  });
  soundSwitch.addEventListener("change", function () { set("sound", soundSwitch.checked); });

  function base64UrlToBytes(text) {
    const padded = (text + "===".slice((text.length + 3) % 4)).replace(/-/g, "+").replace(/_/g, "/");
    const raw = atob(padded);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    return bytes;
  }

  document.getElementById("push-subscribe").addEventListener("click", function () {
    if (!("serviceWorker" in navigator) || !window.PushManager || !window.isSecureContext) {
      pushFeedback.textContent = "This browser cannot receive Web Push here (it needs HTTPS and a browser with the Push API).";
      return;
    }
    pushFeedback.textContent = "Asking the browser…";
    Notification.requestPermission().then(function (permission) {
      if (permission !== "granted") throw new Error("the browser refused notifications for this site");
      return navigator.serviceWorker.ready;
    }).then(function (registration) {
      return registration.pushManager.subscribe({ userVisibleOnly: true, applicationServerKey: base64UrlToBytes(root.dataset.key) });
    }).then(function (subscription) {
      return fetch(root.dataset.subscribeUrl, {
        method: "POST", credentials: "same-origin", body: JSON.stringify(subscription.toJSON()),
        headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
      });
    }).then(function (response) {
      if (!response.ok) return response.json().then(function (body) { throw new Error(body.error || response.status); });
      location.reload();
    }).catch(function (err) {
      pushFeedback.textContent = "Not subscribed: " + (err && err.message ? err.message : err) + ".";
    });
  });
})();
