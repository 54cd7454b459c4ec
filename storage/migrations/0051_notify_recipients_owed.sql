-- An e-mail delivery that some recipients took and others were refused for now: who is still
-- owed the mail (docs/notifications.md, Receivers). An SMTP server greylisting a recipient
-- (451 to its RCPT: "try again later") while taking the mail for the others had the delivery
-- recorded SENT, and the greylisted recipient (an on-call person at another provider) was never
-- mailed. Such a delivery now stays PENDING for the retry, which mails only
-- `recipients_owed` (NULL: every address of the receiver's `to`, nobody reached yet);
-- `recipients_missed` keeps what the server refused for good on the way ("address: answer"
-- parts, "; " between), for the delivery's last_error once it is SENT.
ALTER TABLE notify_delivery ADD COLUMN recipients_owed text[];
ALTER TABLE notify_delivery ADD COLUMN recipients_missed text;
